"""`python -m raysim.up [--num-cpus N] [--dashboard]`: start the warm local service (raysim/service.py)."""
import argparse
import sys

from raysim.service import up


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raysim.up", description="Start raysim's warm local service: a "
                                "local Ray with a warm server that later `python -m raysim.run` commands use.")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs the service's Ray offers (default: all)")
    p.add_argument("--dashboard", action="store_true", help="also start Ray's Dashboard (loopback, the service's token)")
    args = p.parse_args(argv)
    return up(args.num_cpus, dashboard=args.dashboard)


if __name__ == "__main__":
    sys.exit(main())

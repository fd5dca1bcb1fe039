"""`python -m raysim.up [--num-cpus N]`: start the warm local service (raysim/service.py)."""
import argparse
import sys

from raysim.service import up


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raysim.up", description="Start raysim's warm local service: a "
                                "local Ray with a warm server that later `python -m raysim.run` commands use.")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs the service's Ray offers (default: all)")
    args = p.parse_args(argv)
    return up(args.num_cpus)


if __name__ == "__main__":
    sys.exit(main())

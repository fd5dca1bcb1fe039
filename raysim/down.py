"""`python -m raysim.down`: stop the warm local service and every process of its Ray."""
import sys

from raysim.service import down

if __name__ == "__main__":
    sys.exit(down())

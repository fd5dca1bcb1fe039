"""The simulated world, apart from the execution (runtime/: actors, dispatch, placement):
what a deployment would see, drawn or read once from the config and the seed.

- clock.py: simulated time, each client's device (`system.profile`, `system.trace`) and the
  seconds of each training call, round deadlines;
- online.py: who is online when (`system.availability`);
- availability.py: who is there in which round (`clients.join`) and what goes wrong on a
  client (`system.dropout`, `system.stragglers`);
- traces.py: the CSV traces the first two read (device and availability traces).
"""

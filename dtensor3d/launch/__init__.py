"""Launching: what happens around the ranks, on each node.

`preflight.py` checks the machine (devices, the run directory) before any process starts;
`supervise.py` is launch.sh's torchrun (torch's LocalElasticAgent: signals passed on, status
2 final, one line per failed attempt and per job); `nodes.py` lets the nodes of a
multi-node job meet (wait with a line, compare recipes) and watch each other (heartbeats),
and makes every rank die with its node's supervisor. May import config and errors; imports
torch only lazily.
"""

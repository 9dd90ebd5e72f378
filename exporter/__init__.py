"""rankscope's node exporter: serves /metrics for every rank of a node.

It reads the ranks' prometheus_client multiprocess files, derives liveness
and rank states that a rank cannot report about itself (dead, frozen, hung),
and reads the node's GPUs through NVML.
"""

__version__ = "0.1.0"

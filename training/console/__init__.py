"""``rankscope``: the person-facing views of what rankscope measured.

- ``rankscope top``: a live table of every rank of a run, read from the node
  exporters' ``/metrics`` (or from Prometheus), for the engineer on a node
  during a hang.
- ``rankscope report``: one self-contained HTML file with plots of a run,
  read from Prometheus, for the post-mortem.

Both read only what the exporter serves (the metric catalog is the contract);
neither imports torch. The terminal and plotting libraries (rich, matplotlib)
are the ``rankscope[console]`` extra.
"""

"""What the ranks and the node exporter agree on, and nothing else.

* ``catalog``: every metric a rank writes (name, type, help, labels, buckets);
* ``rundir``: the node's metrics directory, the per-run directory layout and
  the rank registration file the exporter reads to tell live from dead;
* ``environment``: the ``RANKSCOPE_*`` settings reader, shared defaults
  (port, address) and the node name;
* ``replicas``: the value a rank publishes for a replica check, as the rules and the
  console read it back;
* ``states``: the states the exporter assigns a rank (``rankscope_rank_state``) and the
  groups of them every reader counts by (stalled, live, ended);
* ``thresholds``: the alert rules' bars that readers show too (generated from
  prometheus/thresholds.yaml).

The exporter imports only this package from the rank side
(``tests/integration/test_package.py`` enforces it), so the two can change independently
as long as this contract holds. Nothing here imports torch or
prometheus_client.
"""

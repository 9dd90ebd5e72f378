"""The read side: a node exporter's ``/metrics`` page as every reader takes it.

Three readers besides Prometheus: ``rankscope top`` and ``rankscope report``
(``rankscope.console``), and rank 0's TensorBoard / MLflow sink (``rankscope.sinks``). They
read through this package, so that a series, and a figure made of series, means one thing to
every reader and to the alert rules:

* ``remote``: where a page is (``page_url``, the one normaliser of ``host:port`` and URLs)
  and the one HTTP GET (``get``, ``fetch``: one-line ``FetchError``);
* ``exposition``: the page's text parsed once, only the lines a reader wants (``parse``);
* ``record``: one ``RankRecord`` per rank of a run, from a page or from a Prometheus instant
  query of the same series (``records``, ``run_records``);
* ``figures``: the run figures (compute per step, the straggler's peer ratio, phase shares,
  goodput, stalled ranks), each defined once with the alert rules' meaning.

Nothing here imports torch; only ``exposition`` imports prometheus_client (its parser).
"""

from rankscope.pages.exposition import Series, escape_label, parse
from rankscope.pages.record import RankRecord, records, run_records
from rankscope.pages.remote import FetchError, fetch, get, page_url

__all__ = ["FetchError", "RankRecord", "Series", "escape_label", "fetch", "get", "page_url", "parse", "records",
           "run_records"]

"""From what the rank collected to the files its node exporter serves.

* ``publisher``: the thread that, every ``publish_interval_s``, takes the finished steps
  and writes the rank's metric files (and beats the heartbeat);
* ``metrics``: the rank's prometheus_client objects, bound once to its identity, in mmap
  files (``mmapfile``);
* ``user_metrics``: the user's own gauges, counters and histograms;
* ``startup``: what a rank does once: claims its run, prepares the run directory,
  describes itself (``rank_info``).
"""

from rankscope.publishing.metrics import RankMetrics
from rankscope.publishing.publisher import Publisher
from rankscope.publishing.user_metrics import UserMetric, UserMetrics

__all__ = ["Publisher", "RankMetrics", "UserMetric", "UserMetrics"]

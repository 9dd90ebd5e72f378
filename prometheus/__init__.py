"""rankscope's Prometheus side: rule source, generator, example configs (not a runtime package)."""

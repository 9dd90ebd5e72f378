"""Replicas: a rank whose weights leave the copies other ranks hold (docs/design.md, "Replicas").

    sets     which tensors of a watched model are replicated, over which process group
    check    their fingerprint every K steps, taken without a sync and published per rank

The comparison happens outside the job, in the rules (prometheus/rules_spec.py, "replicas"):
the ranks never exchange a byte for it.
"""

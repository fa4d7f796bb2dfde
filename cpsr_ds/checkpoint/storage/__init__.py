"""Storage: the file format, atomic writes, records, scan/verify/select, retention, the per-node layout, replicas."""

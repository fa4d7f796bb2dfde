"""Storage: atomic file I/O, the file format, records, the commit, scan/verify/select, retention, nodes, replicas."""

"""The data layer: tracking stores, run lists, metric histories and their readers, traces, alert files."""

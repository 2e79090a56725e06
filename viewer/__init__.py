"""The static single-file HTML viewer and the Perfetto exporter."""

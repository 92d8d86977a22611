"""The analysis layer: divergence from a reference band, config differences, non-finite gradient events."""

"""Thin adapters over the framework-free core (`rldiag.collectors.session`, `rldiag.collectors.gradcheck`,
`rldiag.collectors.metrics`): each imports its framework lazily and names the pip extra when it is missing."""

"""Thin adapters over the framework-free core (`collectors.session`, `collectors.gradcheck`,
`collectors.metrics`): each imports its framework lazily and names the pip extra when it is missing."""

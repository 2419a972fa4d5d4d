"""The torch-free layer every stage shares: image preprocessing, catalogs and item tables,
versioned artifacts, configuration and command-line plumbing, progress reporting and the
retrieval metrics. It imports neither torch nor `serving`; training, index and serving import it."""

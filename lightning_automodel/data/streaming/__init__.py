"""Pre-training rows read and tokenized as training goes, with no cache: each data-parallel rank's share of the
sources (:mod:`.shares`), read unit by unit in a seeded order, documents mixed in a bounded buffer (:mod:`.buffer`),
cut into rows (:mod:`.stream`), resumed exactly from a checkpoint."""

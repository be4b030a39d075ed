"""The data modules: what they share (:mod:`.base`), pre-training text (:mod:`.text`), fine-tuning records
(:mod:`.chat`)."""

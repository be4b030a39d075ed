"""Vision-language models and processors built in code (no download): tiny models of each family with batches and
records of images (:mod:`.models`), and the processors the data modules render with (:mod:`.processors`)."""

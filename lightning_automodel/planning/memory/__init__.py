"""Memory per rank of a planned training step: its activations measured on fake tensors (:mod:`.activations`), the
step's inputs and options (:mod:`.step_options`, :mod:`.step_images`), extrapolated over alike layers
(:mod:`.layer_extrapolation`)."""

"""``lightning-automodel export`` in parts: the checkpoint's model on the meta device and its tensors read by name
(:mod:`.source`), the output shards planned as ``save_pretrained`` plans them (:mod:`.shards`), and safetensors files
written tensor by tensor (:mod:`.safetensors_file`)."""

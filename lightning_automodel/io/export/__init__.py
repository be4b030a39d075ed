"""``lightning-automodel export`` in parts: the checkpoint's model on the meta device and its tensors read by name
(:mod:`.source`), the output shards planned as ``save_pretrained`` plans them (:mod:`.shards`), safetensors files
written tensor by tensor (:mod:`.safetensors_file`), and the directory written shard by shard (:mod:`.writing`)."""

"""Files: Lightning's sharded checkpoints (saved whole or not at all, loaded in any layout), and exports of a model
or a checkpoint as a Hugging Face model directory."""

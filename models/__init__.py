"""Everything that runs the network: model config, layers, the Transformer, attention kernels,
sharding, decode caches, the generation engine and Hugging Face checkpoint import/export."""

"""SGLang 0.5.23's Triton extend-attention kernel, carried for the GPU check's baseline (see ORIGIN.json)."""

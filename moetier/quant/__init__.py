"""Quantized weight formats (codes, scales, packing): one format, read by store/ and by the kernels in model/ alike,
so model/ never imports store/."""

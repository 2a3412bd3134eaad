"""Adapters for training frameworks that need something of their own (each imports its
framework: install the ``integrations`` extra). HF accelerate and Lightning Fabric need none:
see docs/integrations.md.

- ``computectx.integrations.torchtitan``: a torchtitan model converter that rewrites the model
  config's linears into ``Fp8Linear`` ones, and the ``parallelize_fn`` /
  ``post_optimizer_build_fn`` hooks that keep their scaling in step on many ranks.
"""

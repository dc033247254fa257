"""Drop-in integrations of torch_cfm into the pipelines that already run these decoders.

* :mod:`torch_cfm.integrations.stepaudio2`: ``apply_torch_cfm(token2wav_or_flow_or_decoder)``
  serves the CFM decoder of the ``stepaudio2`` package (MiniCPM-o 4.5, Step-Audio2) with
  torch_cfm, in place; ``undo_torch_cfm`` restores it.

Importing an integration never imports the package it integrates with: it works on the objects
the user already built (detected by their shape, not by importing their classes).
"""

#!/bin/sh
# Beam search over encoder-decoder models (T5, BART) through kvtierd against
# Hugging Face's beam decisions over the PyTorch reference.
exec /usr/bin/python3 tests/daemon_encdec_beams.py

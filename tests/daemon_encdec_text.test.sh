#!/bin/sh
# kvtierd with a T5 whose tokenizer is a SentencePiece Unigram model: text input.
exec /usr/bin/python3 tests/daemon_encdec_text.py

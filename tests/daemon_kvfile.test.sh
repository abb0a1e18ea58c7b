#!/bin/sh
# kvtierd KV export and import (safetensors) against the PyTorch reference.
exec /usr/bin/python3 tests/daemon_kvfile.py

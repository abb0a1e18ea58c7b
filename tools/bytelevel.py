"""GPT-2's byte-level alphabet, shared by the tokenizer trainer and mkmodel."""


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable characters, so that a
    byte-level token is a plain string (space -> 'Ġ', newline -> 'Ċ'):
    printable Latin-1 bytes map to themselves, the rest to U+0100 upwards in
    byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table

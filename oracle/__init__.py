"""The analyses of a trace: the block access stream (`stream.py`), cache policies up to the Belady
bound (`policies/`), the vLLM block-pool model (`blockpool.py`), the headroom report (`headroom.py`)
and the family-hold what-if (`pressure.py`). Pure Python over the schema's tables, no engine needed."""

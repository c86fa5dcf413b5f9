"""The adapter feature's floor (issue 48 item 5), between models/ and parallel/: LoRA files used two ways, in one word
each. An *adapter* stays beside the weights in slots and only the requests that name it get it (the wire field
`lora`); a *merged LoRA* (`--lora FILE[:SCALE]`) is merged into the weights at load or build, for every request (given
to a bundle at serve time instead, it is pinned unmerged in a slot of its own and carried by every evaluation:
resident.py).

  merge.py     merged LoRAs: `LoraSpec` (--lora), `merge_loras` / `LoraMerge` (W += scale * B @ A in fp32)
  slots.py     the slots' arithmetic: banks on the main blocks' linears, an evaluation's rank rows (`AdapterSlots`,
               `AdapterRun`, `AdapterBlock`), and the compiled segments' adapter inputs
  stream.py    a LoRA file read once onto the slots' device, hashed as it is read
  memory.py    what slots take in memory, and whether they fit
  shape.py     `SlotShape`: how many slots and their max rank (flags, a bundle's manifest, or fitted)
  spec.py      `AdapterSpec`: --adapter NAME=FILE[:SCALE][@schedule] and --lora-dir's files
  schedule.py  an adapter's own schedule (a Turbo LoRA's steps and shifts)
  info.py      `AdapterInfo`: an adapter's rank, targets and size, as GET /v1/loras lists it
  checks.py    the checks before anything loads: the flags, a bundle's slots; and admission's, a request's `lora`
               against the resident set (`check_adapters`)
  use.py       `AdapterUse`: one entry of a request's `lora`, as stated and as admission resolved it; the one
               bound on a strength (either kind)
  catalog.py   `AdapterCatalog`: the set a server offers by name, changed while it serves (POST/DELETE /v1/loras)
  resident.py  `ResidentAdapters`: one pipeline's slots as a cache keyed by sha256, and what an evaluation carries

The LoRA file format itself (every producer's layout, normalised to diffusers names: models/lora_format.py) and where
its modules land (models/lora_targets.py) stay in models/: its distilled families read Turbo and PDD files with them,
and models/ imports no floor above it. The per-evaluation contract the DiT takes adapters by is models/runner.py's
`DiTAdapters` / `BlockAdapters`.
"""

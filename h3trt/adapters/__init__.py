"""LoRA adapters' floor (issue 48 item 5): what a request asks of the resident adapters (use.py `AdapterUse`), below
the request (h3trt/request/) and the pipeline that run them. The rest of the adapter feature (specs, the catalog, the
slot cache, the adapters' schedules and checks, and the LoRA file and slot code of models/) joins it here."""

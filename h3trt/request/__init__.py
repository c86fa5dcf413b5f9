"""The request's floor (issue 48 item 1): a request typed once (request.py `Request`, made of parts.py's parts) and
admitted once (admitted.py `Admitted`, with the one batch rule `BatchKey.of`). It imports the models and the adapters'
floor only; the pipeline, the job loop and the front doors read it."""

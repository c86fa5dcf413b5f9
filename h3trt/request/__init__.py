"""The request's floor (issue 48 items 1 and 2): the one field table (fields.py: keys, API names, run's flags),
its speed profiles, and parsing (parse.py) make a request typed once (request.py `Request`, made of its parts),
which admission checks once (pipeline/prepare.py); admitted (request.py `Admitted`, with the one batch rule
`BatchKey.of`), it travels to the rank. It imports the models, the adapters' floor and the engines' records only;
the pipeline, the job loop and the front doors read it."""

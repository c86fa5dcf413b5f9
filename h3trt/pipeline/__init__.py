"""One request through the model: the request and its schema, loading, the H3 pipeline (guidance, tile-parallel
decode) and the record a clip leaves beside its MP4."""

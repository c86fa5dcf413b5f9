"""The job loop: a job and its pipe messages, what serves it (model_source.py), admission, the work a rank does, the
rank, and the supervisor that launches a replica group's ranks."""

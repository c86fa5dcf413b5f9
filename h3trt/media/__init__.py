"""Bytes in and out: media inputs read and checked (inputs.py), MP4s written (mp4.py, the pipelined encoder in
encoder.py), and output files that are never lost, mixed up or half-written (output_files.py)."""

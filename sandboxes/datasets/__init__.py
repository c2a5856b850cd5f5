"""Loaders of the SWE datasets people train on: rows in, a task set Undertow runs out.

    formats.py    one DatasetFormat per dataset: row shape, image naming, how to get images
    importer.py   import_dataset(name, source, out_dir) -> ImportReport   (`undertow tasks import`)
    images.py     missing_images(connection, tasks, format)               (names the command)
    patches.py    reverse_patch(diff)                 (SWE-smith's patch makes the bug)

Rows come from local folders only (JSONL files, parquet, or a Hugging Face dataset saved
with `save_to_disk`); nothing is downloaded.
"""

"""The application: the `otbrl` command (`cli`) and what it runs. `train` turns a recipe (`recipe`, keys
documented in `config`) into a TRL run with models and prompts from `sources`; `compare` trains a recipe's
arms x seeds and tables them; `callbacks`, `metrics`, `plots` and `answers` serve those runs. It builds on
the library (`otbrl`) and its TRL adapter; nothing in the library imports it."""

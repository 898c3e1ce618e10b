"""Adapters that put otbrl's estimators into existing trainers. Each imports its framework lazily:
`from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer`."""

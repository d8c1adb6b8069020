"""The decision map (when does untying pay?): the public-domain corpus, the runs, the report."""

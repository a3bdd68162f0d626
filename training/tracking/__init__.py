"""Everything that talks to MLflow: the run and its loggers (``run``), the stdout relay from
rank 0 to the launching task (``relay``), system metrics (``system``) and the run page's text
(``page``). The only part that imports MLflow; of the others it imports ``log`` only."""

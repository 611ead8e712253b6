"""The coordinator <-> worker contract: keys derived from the job's secret, the
authenticated rendezvous store."""

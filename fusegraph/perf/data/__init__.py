"""Cost-model parameter data (``trainium.json``); a package so that wheels ship the data file."""

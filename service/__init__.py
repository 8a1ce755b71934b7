"""The attention service. Importing this package loads nothing: its layers import downward only,

    service.web     Flask: the two front doors (native API, KServe v2), admission, metrics, docs
    service.cost    the cost model: a job's work, the fit that predicts and learns its time, the split policy
    service.transport  the gunicorn worker's event loop: connections, framing, deadlines (knows no app)
    schemas         the domain: request schemas -> jobs (AttentionJob, MhaJob), RequestError
    service.wire    bytes <-> arrays: strict JSON, the tensor encodings, streamed responses
    service.core    the numeric core: attention, mha (numpy only)

and service.config (Settings) may be read by any of them. The app: service.web.create_app()."""

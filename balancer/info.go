package balancer

import "time"

// JobStatus is a registration job as GET /workers/{id} shows it (spec §3.3).
type JobStatus struct {
	JobType   string `json:"job_type"`
	WorkerURL string `json:"worker_url"`
	Status    string `json:"status"` // pending, processing or failed
	Message   string `json:"message,omitempty"`
	Timestamp int64  `json:"timestamp"` // unix seconds of the last change
}

// Job states.
const (
	JobPending    = "pending"
	JobProcessing = "processing"
	JobFailed     = "failed"
)

// WorkerInfo is the JSON shape of a worker in the /workers API (spec §3.3).
type WorkerInfo struct {
	ID                 string            `json:"id"`
	URL                string            `json:"url"`
	ModelID            string            `json:"model_id"`
	Priority           uint32            `json:"priority"`
	Cost               float32           `json:"cost"`
	WorkerType         string            `json:"worker_type"`
	IsHealthy          bool              `json:"is_healthy"`
	Load               int64             `json:"load"`
	ConnectionMode     string            `json:"connection_mode"`
	DisableHealthCheck bool              `json:"disable_health_check"`
	BootstrapPort      *int              `json:"bootstrap_port,omitempty"`
	DPBaseURL          string            `json:"dp_base_url,omitempty"` // these three with --dp-aware only, as smg
	DPRank             *int              `json:"dp_rank,omitempty"`
	DPSize             int               `json:"dp_size,omitempty"`
	Metadata           map[string]string `json:"metadata,omitempty"`
	JobStatus          *JobStatus        `json:"job_status,omitempty"`
}

// Info describes a registered worker.
func (w *Worker) Info() WorkerInfo {
	wi := WorkerInfo{
		ID: w.ID, URL: w.URL, ModelID: w.ModelID, Priority: w.Priority, Cost: w.Cost,
		WorkerType: w.Type.String(), IsHealthy: w.Healthy(), Load: w.Load(),
		ConnectionMode: connectionMode, DisableHealthCheck: w.DisableHealthCheck, Metadata: w.Labels,
	}
	if w.Type == Prefill && w.BootstrapPort != NoBootstrapPort {
		wi.BootstrapPort = &w.BootstrapPort
	}
	if w.DPSize > 0 {
		wi.DPBaseURL, wi.DPRank, wi.DPSize = w.BaseURL, &w.DPRank, w.DPSize
	}
	return wi
}

func newJobStatus(url, status, msg string) *JobStatus {
	return &JobStatus{JobType: "AddWorker", WorkerURL: url, Status: status, Message: msg, Timestamp: time.Now().Unix()}
}

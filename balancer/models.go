package balancer

import (
	"context"
	"encoding/json"
	"net/http"
)

// readModels reads an engine's model from the OpenAI GET /v1/models (the
// first listed), for engines without SGLang's /server_info: vLLM's. It
// learns nothing, without an error, from a reply it cannot read.
func readModels(ctx context.Context, c *http.Client, w *Worker) serverInfo {
	body, status, err := getBody(ctx, c, w, "/v1/models")
	if err != nil || status/100 != 2 {
		return serverInfo{}
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if json.Unmarshal(body, &list) != nil || len(list.Data) == 0 {
		return serverInfo{}
	}
	return serverInfo{model: list.Data[0].ID}
}

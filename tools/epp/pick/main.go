// Command pick asks an endpoint picker which pod should serve each request, as Envoy does:
// one ext-proc stream per request (request headers, then the JSON body), and prints the
// endpoint the picker sets in x-gateway-destination-endpoint, one line per request.
//
//	pick -addr 127.0.0.1:9002 -model alpha -n 4
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const destination = "x-gateway-destination-endpoint"

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "the picker's ext-proc gRPC address")
	model := flag.String("model", "", "the request's model (a base model or an adapter)")
	count := flag.Int("n", 1, "requests to ask about")
	flag.Parse()
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fail(err)
	}
	defer conn.Close()
	client := extproc.NewExternalProcessorClient(conn)
	for i := 0; i < *count; i++ {
		endpoint, err := pick(client, *model, i)
		if err != nil {
			fail(err)
		}
		fmt.Println(endpoint)
	}
}

func pick(client extproc.ExternalProcessorClient, model string, i int) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return "", err
	}
	headers := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/completions")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "x-request-id", RawValue: []byte(fmt.Sprintf("pick-%d-%d", time.Now().UnixNano(), i))},
	}
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": "def main(", "max_tokens": 4, "temperature": 0})
	requests := []*extproc.ProcessingRequest{
		{Request: &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: headers}}}},
		{Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}},
	}
	for _, request := range requests {
		if err := stream.Send(request); err != nil {
			return "", err
		}
	}
	for {
		response, err := stream.Recv()
		if err != nil {
			return "", fmt.Errorf("no %s from the picker: %w", destination, err)
		}
		if immediate := response.GetImmediateResponse(); immediate != nil {
			return "", fmt.Errorf("the picker answered the request itself: %d %s", immediate.GetStatus().GetCode(), immediate.GetBody())
		}
		common := response.GetRequestHeaders().GetResponse()
		if common == nil {
			common = response.GetRequestBody().GetResponse()
		}
		for _, option := range common.GetHeaderMutation().GetSetHeaders() {
			if option.GetHeader().GetKey() == destination {
				value := option.GetHeader().GetRawValue()
				if len(value) == 0 {
					value = []byte(option.GetHeader().GetValue())
				}
				return string(value), nil
			}
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "pick:", err)
	os.Exit(1)
}

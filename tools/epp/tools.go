//go:build tools

// Package tools pins the endpoint picker's command package for scripts/build_k8s.sh.
package tools

import _ "sigs.k8s.io/gateway-api-inference-extension/cmd/epp"

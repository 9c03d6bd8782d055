package etcdsynctest

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// connectTimeout bounds Connect's first request to ETCD_ENDPOINTS.
const connectTimeout = 5 * time.Second

// StartServer starts one embedded etcd member on 127.0.0.1 and random
// ports, with its data in a new temporary directory, for a program that has
// no testing.TB (a godoc example, a demo). It prints nothing. It blocks
// until the member serves (at most 30s); an error leaves nothing running.
// stop stops the member and removes its data; it blocks until the member
// has stopped and may be called more than once.
func StartServer() (endpoints []string, stop func(), err error) {
	dir, err := os.MkdirTemp("", "etcdsynctest-")
	if err != nil {
		return nil, nil, fmt.Errorf("etcdsynctest: %w", err)
	}
	rig, err := etcdtest.StartCluster(dir, etcdtest.Options{})
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, fmt.Errorf("etcdsynctest: %w", err)
	}
	return rig.Endpoints(), sync.OnceFunc(func() { rig.Close(); os.RemoveAll(dir) }), nil
}

// Connect returns a client for a program or an example: of the endpoints in
// ETCD_ENDPOINTS (comma-separated) when it is set, else in ETCDCTL_ENDPOINTS
// (as etcdctl and lockctl read), else of one embedded member that it starts
// (as StartServer). The client logs errors only (etcd's client's retry
// warnings are not printed). With endpoints from the environment, the client
// speaks TLS when ETCD_CACERT (a CA bundle to trust) or ETCD_CERT and
// ETCD_KEY (a client certificate and its key) name PEM files, and
// authenticates when ETCD_USER is set (user, or user:password as etcdctl's
// --user; else the password is ETCD_PASSWORD); an endpoint https://… with
// none of the files set trusts the system's CAs. It prints to standard output
// which one it did and where. With ETCD_ENDPOINTS it makes one read (of the
// key "health", as etcdctl's health check does) to see that etcd answers,
// bounded by 5s. An error leaves nothing open or running. close closes the
// client and stops the member it started, if any; it blocks until both are
// done and may be called more than once.
func Connect() (cli *clientv3.Client, close func(), err error) {
	name, env := endpointsEnv(os.Getenv)
	return connect(os.Stdout, name, env, os.Getenv)
}

// endpointsEnv returns the variable Connect takes its endpoints from, and
// its value: ETCD_ENDPOINTS when set, else ETCDCTL_ENDPOINTS.
func endpointsEnv(getenv func(string) string) (name, value string) {
	if v := getenv("ETCD_ENDPOINTS"); strings.TrimSpace(v) != "" {
		return "ETCD_ENDPOINTS", v
	}
	return "ETCDCTL_ENDPOINTS", getenv("ETCDCTL_ENDPOINTS")
}

// quietLogger is etcd's client's logger for Connect's programs: errors
// only, as JSON on standard error.
func quietLogger() *zap.Logger {
	c := zap.NewProductionConfig()
	c.Level = zap.NewAtomicLevelAt(zap.ErrorLevel)
	lg, err := c.Build()
	if err != nil {
		return zap.NewNop()
	}
	return lg
}

// connect is Connect with its endpoints in env (the value of the variable
// name), its TLS and user variables looked up with getenv, and its message
// written to w.
func connect(w io.Writer, name, env string, getenv func(string) string) (*clientv3.Client, func(), error) {
	var endpoints []string
	for _, ep := range strings.Split(env, ",") {
		if ep = strings.TrimSpace(ep); ep != "" {
			endpoints = append(endpoints, ep)
		}
	}
	if len(endpoints) == 0 {
		return connectEmbedded(w)
	}
	cfg := etcdtest.ClientConfig(endpoints)
	cfg.Logger = quietLogger()
	if err := secure(&cfg, getenv); err != nil {
		return nil, nil, fmt.Errorf("etcdsynctest: %s=%s: %w", name, env, err)
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("etcdsynctest: %s=%s: %w", name, env, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), connectTimeout)
	defer cancel()
	if _, err := cli.Get(ctx, "health", clientv3.WithCountOnly()); err != nil {
		cli.Close()
		return nil, nil, fmt.Errorf("etcdsynctest: %s=%s: no answer within %v: %w", name, env, connectTimeout, err)
	}
	fmt.Fprintf(w, "connected to %s=%s\n", name, strings.Join(endpoints, ","))
	return cli, sync.OnceFunc(func() { cli.Close() }), nil
}

// secure sets cfg's TLS and credentials from the variables Connect reads
// (see Connect), looked up with getenv.
func secure(cfg *clientv3.Config, getenv func(string) string) error {
	ca, cert, key := getenv("ETCD_CACERT"), getenv("ETCD_CERT"), getenv("ETCD_KEY")
	if (cert == "") != (key == "") {
		return fmt.Errorf("ETCD_CERT and ETCD_KEY go together (ETCD_CERT=%q, ETCD_KEY=%q)", cert, key)
	}
	if ca != "" || cert != "" {
		info := transport.TLSInfo{TrustedCAFile: ca, CertFile: cert, KeyFile: key}
		tlsCfg, err := info.ClientConfig()
		if err != nil {
			return fmt.Errorf("TLS from ETCD_CACERT, ETCD_CERT, ETCD_KEY: %w", err)
		}
		cfg.TLS = tlsCfg
	}
	if user := getenv("ETCD_USER"); user != "" {
		name, password, ok := strings.Cut(user, ":")
		if !ok {
			password = getenv("ETCD_PASSWORD")
		}
		cfg.Username, cfg.Password = name, password
	}
	return nil
}

func connectEmbedded(w io.Writer) (*clientv3.Client, func(), error) {
	endpoints, stop, err := StartServer()
	if err != nil {
		return nil, nil, err
	}
	cfg := etcdtest.ClientConfig(endpoints)
	cfg.Logger = quietLogger()
	cli, err := clientv3.New(cfg)
	if err != nil {
		stop()
		return nil, nil, fmt.Errorf("etcdsynctest: %w", err)
	}
	fmt.Fprintf(w, "started an embedded etcd at %s (set ETCD_ENDPOINTS to use a real cluster)\n", strings.Join(endpoints, ","))
	return cli, sync.OnceFunc(func() { cli.Close(); stop() }), nil
}

//go:build unix

package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/etcdsync/etcdsync/internal/reach"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/namespace"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// connFlags are etcdctl's connection flags.
type connFlags struct {
	endpoints          []string
	cacert, cert, key  string
	insecureSkipVerify bool
	user, password     string
	dialTimeout        time.Duration
	namespace          string // prefix of every key, as clientv3/namespace applies it
	debug              bool   // etcd's client logs its warnings and debug records too, not only its errors
}

// register adds the flags to fs.
func (c *connFlags) register(fs *pflag.FlagSet) {
	fs.StringSliceVar(&c.endpoints, "endpoints", []string{"127.0.0.1:2379"}, "etcd endpoints, comma-separated")
	fs.StringVar(&c.cacert, "cacert", "", "verify the servers' certificates with this CA bundle")
	fs.StringVar(&c.cert, "cert", "", "client TLS certificate file")
	fs.StringVar(&c.key, "key", "", "client TLS key file")
	fs.BoolVar(&c.insecureSkipVerify, "insecure-skip-tls-verify", false, "do not verify the servers' certificates (testing only)")
	fs.StringVar(&c.user, "user", "", "user for authentication, as NAME:PASSWORD or NAME (with --password)")
	fs.StringVar(&c.password, "password", "", "password for authentication")
	fs.DurationVar(&c.dialTimeout, "dial-timeout", 5*time.Second, "how long to try to reach etcd before giving up (exit 1)")
	fs.BoolVar(&c.debug, "debug", false, "let etcd's client log its warnings and debug records on stderr (JSON); by default it logs only errors")
	fs.StringVar(&c.namespace, "namespace", "", "prefix of every key lockctl reads and writes, as a client wrapped by clientv3/namespace (or etcd grpc-proxy --namespace) applies it: lock NAME lives under NAMESPACE+NAME/")
}

// envVars maps each connection flag to its environment variables, first
// found first: etcdctl's, and for the endpoints also ETCD_ENDPOINTS, which
// the examples and etcdsynctest.Connect read.
var envVars = map[string][]string{
	"endpoints":                {"ETCDCTL_ENDPOINTS", "ETCD_ENDPOINTS"},
	"cacert":                   {"ETCDCTL_CACERT"},
	"cert":                     {"ETCDCTL_CERT"},
	"key":                      {"ETCDCTL_KEY"},
	"insecure-skip-tls-verify": {"ETCDCTL_INSECURE_SKIP_TLS_VERIFY"},
	"user":                     {"ETCDCTL_USER"},
	"password":                 {"ETCDCTL_PASSWORD"},
	"dial-timeout":             {"ETCDCTL_DIAL_TIMEOUT"},
}

// fromEnv sets each connection flag not given on the command line from the
// first of its environment variables that is set and not empty. A bad value
// is a usage error.
func (c *connFlags) fromEnv(fs *pflag.FlagSet) error {
	for flag, envs := range envVars {
		f := fs.Lookup(flag)
		if f == nil || f.Changed {
			continue
		}
		for _, env := range envs {
			val := os.Getenv(env)
			if val == "" {
				continue
			}
			if err := f.Value.Set(val); err != nil {
				return usage(fmt.Errorf("%s=%q: %w", env, val, err))
			}
			break
		}
	}
	return nil
}

// config returns the client configuration the flags describe; bad
// combinations are usage errors. It reads the TLS files.
func (c *connFlags) config() (clientv3.Config, error) {
	cfg := clientv3.Config{
		Endpoints:   c.endpoints,
		DialTimeout: c.dialTimeout,
		Logger:      clientLogger(c.debug),
	}
	if len(c.endpoints) == 0 || c.endpoints[0] == "" {
		return cfg, usage(errors.New("--endpoints is empty"))
	}
	if c.dialTimeout <= 0 {
		return cfg, usage(fmt.Errorf("--dial-timeout %v: want a positive duration", c.dialTimeout))
	}
	if c.user != "" {
		name, pass, hasPass := strings.Cut(c.user, ":")
		if !hasPass {
			pass = c.password
		}
		if name == "" || pass == "" {
			return cfg, usage(errUserPassword)
		}
		cfg.Username, cfg.Password = name, pass
	}
	if (c.cert == "") != (c.key == "") {
		return cfg, usage(errCertKey)
	}
	if c.cacert == "" && c.cert == "" && !c.insecureSkipVerify {
		return cfg, nil // https:// endpoints still use TLS, with the system's roots
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: c.insecureSkipVerify}
	if c.cacert != "" {
		pem, err := os.ReadFile(c.cacert)
		if err != nil {
			return cfg, fail(exitFailure, fmt.Errorf("--cacert: %w", err))
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return cfg, fail(exitFailure, fmt.Errorf("--cacert %s: no PEM certificate in it", c.cacert))
		}
	}
	if c.cert != "" {
		pair, err := tls.LoadX509KeyPair(c.cert, c.key)
		if err != nil {
			return cfg, fail(exitFailure, fmt.Errorf("--cert/--key: %w", err))
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	cfg.TLS = tc
	return cfg, nil
}

// clientLogger is the logger of etcd's client: JSON on stderr, errors only
// (its "retrying of unary invoker failed" warnings say what lockctl reports
// in one line), or everything from debug up with --debug.
func clientLogger(debug bool) *zap.Logger {
	level := zapcore.ErrorLevel
	if debug {
		level = zapcore.DebugLevel
	}
	return zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.Lock(os.Stderr), level))
}

// dial connects to etcd (under --namespace, if given) and checks that it
// answers: one count-only read of prefix, bounded by --dial-timeout and by
// ctx. It blocks for that long at most (authentication, when --user is
// given, is bounded the same way). ctx is the client's context: once the
// client is returned, ending ctx ends the client. The caller closes the
// client.
func (c *connFlags) dial(ctx context.Context, prefix string) (*clientv3.Client, error) {
	cfg, err := c.config()
	if err != nil {
		return nil, err
	}
	cfg.Context = ctx
	where := strings.Join(c.endpoints, ",")
	cli, err := clientv3.New(cfg) // authenticates, with --user
	if err != nil {
		if ctx.Err() != nil { // interrupted: the caller says why
			return nil, ctx.Err()
		}
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no answer within --dial-timeout %v%s", c.dialTimeout, connError(cfg))
		}
		return nil, fmt.Errorf("etcd at %s: %w", where, err)
	}
	if c.namespace != "" {
		cli.KV = namespace.NewKV(cli.KV, c.namespace)
		cli.Watcher = namespace.NewWatcher(cli.Watcher, c.namespace)
		cli.Lease = namespace.NewLease(cli.Lease, c.namespace)
	}
	pctx, cancel := context.WithTimeout(ctx, c.dialTimeout)
	defer cancel()
	_, err = cli.Get(pctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err == nil {
		return cli, nil
	}
	cli.Close()
	if ctx.Err() != nil { // interrupted: the caller says why
		return nil, ctx.Err()
	}
	if errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("no answer within --dial-timeout %v%s", c.dialTimeout, connError(cfg))
	}
	return nil, fmt.Errorf("etcd at %s: %w", where, err)
}

// connError returns why cfg's endpoints cannot be reached, as " (reason)",
// or "" when that is not known: it dials their addresses (with cfg's TLS),
// bounded by 500ms, and sends nothing to etcd (see internal/reach).
func connError(cfg clientv3.Config) string {
	tc := cfg.TLS
	if tc == nil { // https:// endpoints still use TLS, with the system's roots
		tc = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	if why := reach.Why(cfg.Endpoints, tc, 500*time.Millisecond); why != "" {
		return " (" + why + ")"
	}
	return ""
}
